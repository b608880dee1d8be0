-- prune_history: forget the history of jobs that are no longer stored. A replayed job keeps
-- its history while it waits, and drops it lazily once delivered (or cancelled, or purged):
-- the delivery scripts only delete its envelope, and dead replay and purge call this on
-- every id in history.
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] history  HASH  {zdelay:3}:history   id -> its earlier deaths
-- ARGV[1..] ids found in history
-- Returns: the number of history entries deleted (ids without an envelope)
-- Re-run safety: yes.
local pruned = 0
for _, id in ipairs(ARGV) do
  if redis.call('HEXISTS', KEYS[1], id) == 0 and redis.call('HDEL', KEYS[2], id) == 1 then
    pruned = pruned + 1
  end
end
return pruned
