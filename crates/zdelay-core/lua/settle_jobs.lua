-- settle_jobs: record what became of the jobs a two-phase sink's publisher claimed, fenced by
-- the claim's token. Each job is settled only if it is still in inflight under the score of the
-- claim it was claimed with (include lease): a publisher whose lease ran out (the job was
-- reclaimed, or replaced, or cancelled), or that settles again after a lost reply, can never
-- ack, retry, release or kill a job someone else now owns.
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] dead      ZSET  {zdelay:3}:dead
-- KEYS[5] reasons   HASH  {zdelay:3}:reasons
-- KEYS[6] scheduled HASH  {zdelay:3}:scheduled  id -> "<scheduled due> <token>" (the due kept
--                                               across retries, releases and hand-overs)
-- KEYS[7] ready     ZSET  {zdelay:3}:ready      member = "<sink>\n<due, 16 digits>\n<id>", score 0
-- KEYS[8] ready_ids HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[9] claims    HASH  {zdelay:3}:claims     token -> the claim's ids and scheduled dues
--                                               (include lease; dropped with its last job)
-- KEYS[10] shards   STRING {zdelay:3}:shards     the shard's marker: its count once resharded
-- KEYS[11] unique  HASH  {zdelay:3}:unique     id -> its unique_for window ms (enqueue_jobs)
-- KEYS[12] windows ZSET  {zdelay:3}:windows    "u:<id>" -> ms until which its id is a duplicate
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_LAYOUT <layout> <min version> once a newer storage layout owns the shard (marker
--   "layout <layout> <min version>"). While zdelay upgrade moves the shard ("upgrading …"), or
--   zdelay reshard moves a layout-2 spread shard online (the new count), the settle lands: both
--   move jobs in flight only once they are settled, and the token fences the settle.
-- ARGV[2] the claim's token (claim_jobs), the fence
-- ARGV[3] wake channel; ARGV[4] shard number
-- ARGV[5] "now" in ms; "" = Redis TIME (a namespace's test clock passes its time)
-- ARGV[6] A, the number of jobs delivered (acked: each is removed); then their A ids
-- ARGV[7 + A..] quadruples for the others: op, id, a, b
--   "retry"   back to due at a (ms); b = envelope with attempt and last_error updated
--             (retry, release and due keep the scheduled due in KEYS[6], so the idempotency key
--             holds)
--   "release" waits for sink b in the ready set again at its scheduled due a (ms), no attempt
--             counted: its sink is unavailable (b = the claiming sink), or its route now names
--             another sink (a hand-over)
--   "due"     back to due at a (ms), envelope kept, no attempt counted: its route is now a local
--             list, which move_due pushes                              (b unused)
--   "dead"    a = reason; b = envelope to keep ("" keeps the stored one)
-- Returns: { settled, fenced } where fenced counts jobs whose lease was no longer ours.
-- Re-run safety: yes; after a first run the fence no longer matches, so nothing repeats.

-- Layout fence: refuse a shard its caller computed with another shard count. While zdelay
-- upgrade moves the shard ("upgrading …"), or zdelay reshard moves it online (a count), a
-- settle still lands: both wait for the jobs in flight to settle before they move them, so
-- none is delivered twice (a settle of a job no longer here finds no lease and does nothing).
local layout = redis.call('GET', KEYS[10])
if layout and layout ~= ARGV[1] and string.sub(layout, 1, 10) ~= 'upgrading ' and not string.find(layout, '^%d+$') then
  local newer = string.match(layout, '^layout (.+)') or string.match(layout, '^upgrading (.+)')
  if newer then
    return redis.error_reply('ZDELAY_LAYOUT ' .. newer)
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
local due_key, jobs_key, inflight_key, dead_key, reasons_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local scheduled_key, ready_key, ready_ids_key = KEYS[6], KEYS[7], KEYS[8]
local token = ARGV[2]
-- @include clock
local now_ms = math.floor(clock_us(tonumber(ARGV[5])) / 1000)
local unique_key, windows_key = KEYS[11], KEYS[12]
local claims_key = KEYS[9]
-- @include remember
-- @include lease
local settled, fenced = 0, 0
local earliest = nil
-- Ownership of the whole batch in one read: a job is ours while its inflight score is this
-- claim's.
local acks = tonumber(ARGV[6])
local ids = {}
for i = 7, 6 + acks do ids[#ids + 1] = ARGV[i] end
for i = 8 + acks, #ARGV, 4 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return { 0, 0 } end
local leased = redis.call('ZMSCORE', inflight_key, unpack(ids))
local ours = token_score(token)
-- The jobs that go back to due or to the ready set keep the due they were scheduled for.
local kept, kept_scores = {}, {}
-- Acks, the commonest outcome, are written in one command per key at the end.
local acked, seen, died = {}, {}, {}
for n = 1, #ids do
  local id = ids[n]
  -- An id named twice settles once: the second finds it no longer leased, as it would
  -- after the first had run alone.
  if leased[n] and not seen[id] and tonumber(leased[n]) == ours then
    seen[id] = true
    if n <= acks then
      acked[#acked + 1] = id
    else
      local at = 7 + acks + 4 * (n - acks - 1)
      local op, a, b = ARGV[at], ARGV[at + 2], ARGV[at + 3]
      redis.call('ZREM', inflight_key, id)
      if op ~= 'dead' then
        kept[#kept + 1] = id
        kept_scores[#kept_scores + 1] = leased[n]
      end
      if op == 'retry' or op == 'due' then
        local due = tonumber(a)
        redis.call('ZADD', due_key, due, id)
        if op == 'retry' then redis.call('HSET', jobs_key, id, b) end
        if earliest == nil or due < earliest then earliest = due end
      elseif op == 'release' then
        local member = b .. '\n' .. string.format('%016d', math.floor(tonumber(a))) .. '\n' .. id
        redis.call('ZADD', ready_key, 0, member)
        redis.call('HSET', ready_ids_key, id, member)
      else
        died[#died + 1] = id
        redis.call('HDEL', scheduled_key, id)
        redis.call('ZADD', dead_key, now_ms, id)
        redis.call('HSET', reasons_key, id, a)
        if b ~= '' then redis.call('HSET', jobs_key, id, b) end
      end
    end
    settled = settled + 1
  else
    fenced = fenced + 1
  end
end
if #kept > 0 then keep_dues(kept, kept_scores) end
if #acked > 0 then
  redis.call('ZREM', inflight_key, unpack(acked))
  redis.call('HDEL', jobs_key, unpack(acked))
  if redis.call('HLEN', scheduled_key) > 0 then redis.call('HDEL', scheduled_key, unpack(acked)) end
  remember(acked)
end
remember(died)
-- Also when nothing settled: every job of the claim may have been replaced meanwhile.
drop_finished_claims({ [token] = true })
if earliest ~= nil then
  local head = redis.call('ZRANGE', due_key, 0, 0, 'WITHSCORES')
  if head[2] and tonumber(head[2]) >= earliest then
    redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' ' .. string.format('%d', earliest))
  end
end
return { settled, fenced }
