-- prune_history_lane: forget the history of a route lane's jobs that are no longer stored
-- (storage layout 2), as prune_history does for a shard: a replayed job keeps its history
-- while it waits, and drops it lazily once delivered or cancelled.
-- KEYS[1] jobs     HASH   zdelay:{emj}:jobs:<route>     stored id -> payload (raw bytes)
-- KEYS[2] history  HASH   zdelay:{emj}:history:<route>  stored id -> its earlier deaths
-- KEYS[3] marker   STRING zdelay:{emj}:lane:<route>     "2 <lane> <LPUSH|RPUSH> <list key>"
-- ARGV[1] the marker the caller expects. Another value refuses the call, writing nothing:
--   ZDELAY_LANE_MOVED <successor>, ZDELAY_LANE_CHANGED <marker> or ZDELAY_NO_LANE (as enqueue_lane)
-- ARGV[2..] stored ids found in history
-- Returns: the number of history entries deleted (ids without a payload)
-- Re-run safety: yes.

local lane_marker = KEYS[3]
-- @include lane_fence
local pruned = 0
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    pruned = pruned + redis.call('HDEL', KEYS[2], ARGV[i])
  end
end
return pruned
