-- cancel_job: cancel a pending job by id, O(log N): one due later, or due and waiting for its
-- two-phase sink in the ready set.
-- KEYS[1] due       ZSET  {zdelay:3}:due
-- KEYS[2] jobs      HASH  {zdelay:3}:jobs
-- KEYS[3] inflight  ZSET  {zdelay:3}:inflight
-- KEYS[4] scheduled HASH  {zdelay:3}:scheduled
-- KEYS[5] ready     ZSET  {zdelay:3}:ready
-- KEYS[6] ready_ids HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[7] max_lateness HASH {zdelay:3}:max_lateness
-- KEYS[8] shards   STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- KEYS[9] unique   HASH  {zdelay:3}:unique      id -> its unique_for window (required: a
--                                                cancelled job's window goes with it, so a
--                                                later job of its id never inherits it)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] job id
-- Returns: 1 cancelled; 0 not pending (already delivered, dead, or never enqueued);
--   -1 in flight (claimed by a two-phase sink; it is being delivered)
-- Re-run safety: yes; a second run returns 0.
-- @include validate
-- Every argument is checked before anything is read or written (ZDELAY_BAD_REQUEST <field>: …).
if #KEYS ~= 9 then return bad_request('keys', keys_problem('9'), tostring(#KEYS)) end
if #ARGV ~= 2 then return bad_request('arguments', 'this function takes 2: shards, id', tostring(#ARGV)) end
local why = shards_problem(ARGV[1])
if why then return bad_request('shards', why, ARGV[1]) end
why = id_problem(ARGV[2])
if why then return bad_request('id', why, ARGV[2]) end

local shard_marker = KEYS[8]
-- @include shard_fence
local id = ARGV[2]
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
  redis.call('HDEL', KEYS[9], id)
  return 1
end
if redis.call('ZSCORE', KEYS[3], id) then return -1 end
return 0
