-- prune_history: forget the history of jobs that are no longer stored. A replayed job keeps
-- its history while it waits, and drops it lazily once delivered (or cancelled, or purged):
-- the delivery scripts only delete its envelope, and dead replay and purge call this on
-- every id in history.
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] history  HASH  {zdelay:3}:history   id -> its earlier deaths
-- KEYS[3] shards   STRING {zdelay:3}:shards     the shard's marker (shard_fence)
-- ARGV[1] the caller's shard count (shard_fence: a marker that differs refuses the call)
-- ARGV[2..] ids found in history
-- Returns: the number of history entries deleted (ids without an envelope)
-- Re-run safety: yes.

local shard_marker = KEYS[3]
-- @include shard_fence
local pruned = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[1], id) == 0 and redis.call('HDEL', KEYS[2], id) == 1 then
    pruned = pruned + 1
  end
end
return pruned
