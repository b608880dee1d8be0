-- enqueue_jobs: add jobs to one shard and wake its poller when one of them becomes the new head.
-- KEYS[1] due       ZSET  {zdelay:3}:due       member = id, score = due ms
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs      id -> envelope
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] dead      ZSET  {zdelay:3}:dead
-- KEYS[5] reasons   HASH  {zdelay:3}:reasons   id -> why it died
-- KEYS[6] scheduled HASH  {zdelay:3}:scheduled  id -> scheduled due of a two-phase job
-- KEYS[7] ready     ZSET  {zdelay:3}:ready      two-phase jobs waiting for their sink
-- KEYS[8] ready_ids HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[9] max_lateness HASH {zdelay:3}:max_lateness id -> ms after its due beyond which the job
--                                               is not delivered (dead, "expired")
-- KEYS[10] shards   STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- KEYS[11] unique  HASH  {zdelay:3}:unique     id -> its unique_for window ms, while it waits
-- KEYS[12] windows ZSET  {zdelay:3}:windows    "u:<id>" -> ms until which the id, delivered or
--                                               dead, is answered as a duplicate; "d:<id>" ->
--                                               the latest due a debounced job may be pushed to.
--                                               Both are optional (a caller that never sends
--                                               "debounce" or "unique" may leave them out).
-- ARGV[2] policy for an id that exists: "replace" | "keep" | "error" | "debounce <max_wait ms>"
--   ("replace", but a job still waiting keeps its due no later than its first enqueue plus
--   max_wait), then optionally " unique <ms>": once delivered or dead, the id is remembered for
--   that long, and a call with " unique" finds an id remembered so answered 3 (duplicate)
--   whatever the policy; then optionally " clock <ms>": the namespace's test clock's offset
--   (its schema's clock_ms), added to Redis TIME wherever the call reads the time (a "+N" due,
--   debounce, unique windows).
-- ARGV[3] wake channel (zdelay:wake); ARGV[4] shard number, sent in the wake message
-- ARGV[5..] quadruples: id, due, envelope, max lateness in ms ("" = none). due is epoch ms, or
--   "+N" for N ms after Redis TIME.
-- Returns: one integer per job, in order: 1 added, 2 replaced, 0 kept (existing left as is),
--   -1 exists (policy "error"; nothing written for that job), 3 duplicate (delivered or dead
--   within its unique window; nothing written). A malformed policy is refused with
--   ZDELAY_BAD_REQUEST policy: …, writing nothing.
-- Re-run safety: yes. "replace" rewrites the same state; "keep"/"error" see the first run's writes.

-- @include validate
-- Every argument of every job is checked before the first write: a bad one refuses the call
-- whole (ZDELAY_BAD_REQUEST <field>: …, naming the job by its place in the call).
if #KEYS ~= 10 and #KEYS ~= 12 then return bad_request('keys', keys_problem('10 or 12'), tostring(#KEYS)) end
local why = shards_problem(ARGV[1])
if why then return bad_request('shards', why, ARGV[1]) end
why = policy_problem(ARGV[2])
if why then return bad_request('policy', why, ARGV[2]) end
if not ARGV[3] or ARGV[3] == '' then return bad_request('wake channel', 'must not be empty', ARGV[3]) end
if not string.find(ARGV[4] or '', '^%d%d?%d?%d?%d?$') or tonumber(ARGV[4]) >= tonumber(ARGV[1]) then
  return bad_request('shard', 'must be the shard number, 0 to shards - 1', ARGV[4])
end
if (#ARGV - 4) % 4 ~= 0 then
  return bad_request('job ' .. math.floor((#ARGV - 4) / 4) + 1, 'each job takes 4 arguments: id, due, frame, max lateness', nil)
end
for i = 5, #ARGV, 4 do
  local n = (i - 1) / 4
  why = id_problem(ARGV[i], true)
  if why then return bad_request('job ' .. n .. ' id', why, ARGV[i]) end
  why = due_problem(ARGV[i + 1])
  if why then return bad_request('job ' .. n .. ' due', why, ARGV[i + 1]) end
  -- zd1:<dest>\n<meta length>\n<meta JSON><payload>
  local frame = ARGV[i + 2]
  local _, head_end, meta_len = string.find(frame, '^zd1:[^\n]+\n(%d%d?%d?%d?%d?%d?%d?%d?%d?)\n')
  meta_len = tonumber(meta_len)
  if not meta_len or meta_len > #frame - head_end or (meta_len > 0 and
      (string.byte(frame, head_end + 1) ~= 123 or string.byte(frame, head_end + meta_len) ~= 125)) then
    return bad_request('job ' .. n .. ' frame', 'must be zd1:<dest>\\n<meta length>\\n<meta JSON object><payload>', frame)
  end
  why = lateness_problem(ARGV[i + 3])
  if why then return bad_request('job ' .. n .. ' max lateness', why, ARGV[i + 3]) end
end

local shard_marker = KEYS[10]
-- @include shard_fence
local due_key, jobs_key, inflight_key, dead_key, reasons_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local scheduled_key, ready_key, ready_ids_key, max_lateness_key = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local unique_key, windows_key = KEYS[11], KEYS[12]
-- @include clock
-- @include enqueue_policy

local stride = 4

-- A replaced job leaves whatever state it was in: dead, waiting for its sink, or claimed by a
-- two-phase sink (whose fenced ack then fails, so the old version is not acknowledged over the
-- new one).
local function leave(id)
  redis.call('ZREM', dead_key, id)
  redis.call('HDEL', reasons_key, id)
  redis.call('ZREM', inflight_key, id)
  redis.call('HDEL', scheduled_key, id)
  local member = redis.call('HGET', ready_ids_key, id)
  if member then
    redis.call('ZREM', ready_key, member)
    redis.call('HDEL', ready_ids_key, id)
  end
end

-- The frame, and the max lateness beside it.
local function store(i, id, exists)
  redis.call('HSET', jobs_key, id, ARGV[i + 2])
  if ARGV[i + 3] ~= '' then
    redis.call('HSET', max_lateness_key, id, ARGV[i + 3])
  elseif exists then
    redis.call('HDEL', max_lateness_key, id)
  end
end
-- @include enqueue_body
