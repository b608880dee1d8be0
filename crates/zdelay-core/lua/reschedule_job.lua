-- reschedule_job: move a pending job to a new due time, O(log N), waking the poller on a new
-- head. A job waiting for its two-phase sink in the ready set goes back to due.
-- KEYS[1] due        ZSET  {zdelay:3}:due
-- KEYS[2] scheduled  HASH  {zdelay:3}:scheduled  (a new schedule forgets the old one)
-- KEYS[3] ready      ZSET  {zdelay:3}:ready
-- KEYS[4] ready_ids  HASH  {zdelay:3}:ready_ids  id -> its member in ready
-- KEYS[5] shards    STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2] job id
-- ARGV[3] new due: epoch ms, or "+N" for N ms after Redis TIME
-- ARGV[4] wake channel (zdelay:wake); ARGV[5] shard number
-- Returns: the new due ms, or -1 when the job is not pending (delivered, dead, in flight, unknown)
-- Re-run safety: yes (absolute times); a relative time is measured again from the re-run.

-- @include validate
-- Every argument is checked before anything is read or written (ZDELAY_BAD_REQUEST <field>: …).
if #KEYS ~= 5 then return bad_request('keys', keys_problem('5'), tostring(#KEYS)) end
if #ARGV ~= 5 then return bad_request('arguments', 'this function takes 5: shards, id, new due, wake channel, shard', tostring(#ARGV)) end
local why = shards_problem(ARGV[1])
if why then return bad_request('shards', why, ARGV[1]) end
why = id_problem(ARGV[2])
if why then return bad_request('id', why, ARGV[2]) end
why = due_problem(ARGV[3])
if why then return bad_request('new due', why, ARGV[3]) end
if ARGV[4] == '' then return bad_request('wake channel', 'must not be empty', ARGV[4]) end
if not string.find(ARGV[5], '^%d%d?%d?%d?%d?$') or tonumber(ARGV[5]) >= tonumber(ARGV[1]) then
  return bad_request('shard', 'must be the shard number, 0 to shards - 1', ARGV[5])
end

local shard_marker = KEYS[5]
-- @include shard_fence
-- @include clock
local id = ARGV[2]
if not redis.call('ZSCORE', KEYS[1], id) then
  local member = redis.call('HGET', KEYS[4], id)
  if not member then return -1 end
  redis.call('ZREM', KEYS[3], member)
  redis.call('HDEL', KEYS[4], id)
end
local due
if string.sub(ARGV[3], 1, 1) == '+' then
  -- Redis TIME: a producer on a test clock adds its offset to N itself.
  due = math.floor(clock_us() / 1000) + tonumber(string.sub(ARGV[3], 2))
else
  due = tonumber(ARGV[3])
end
redis.call('ZADD', KEYS[1], due, id)
redis.call('HDEL', KEYS[2], id)
local head = redis.call('ZRANGE', KEYS[1], 0, 0)
if head[1] == id then
  redis.call('PUBLISH', ARGV[4], ARGV[5] .. ' ' .. string.format('%d', due))
end
return due
