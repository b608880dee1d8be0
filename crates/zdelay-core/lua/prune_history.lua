-- prune_history: forget the history of jobs that are no longer stored. A replayed job keeps
-- its history while it waits, and drops it lazily once delivered (or cancelled, or purged):
-- the delivery scripts only delete its envelope, and dead replay and purge call this on
-- every id in history.
-- KEYS[1] jobs     HASH  {zdelay:3}:jobs
-- KEYS[2] history  HASH  {zdelay:3}:history   id -> its earlier deaths
-- KEYS[3] shards   STRING {zdelay:3}:shards     layout marker: the shard count once resharded, or
--                                                "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs,
--   or ZDELAY_LAYOUT <layout> <min version> once a newer storage layout owns the shard (marker
--   "layout <layout> <min version>", or "upgrading …" while it moves in)
-- ARGV[2..] ids found in history
-- Returns: the number of history entries deleted (ids without an envelope)
-- Re-run safety: yes.

-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[3])
if layout and layout ~= ARGV[1] then
  if string.sub(layout, 1, 10) == 'migrating ' then
    return redis.error_reply('ZDELAY_MIGRATING ' .. string.sub(layout, 11))
  end
  local newer = string.match(layout, '^layout (.+)') or string.match(layout, '^upgrading (.+)')
  if newer then
    return redis.error_reply('ZDELAY_LAYOUT ' .. newer)
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
local pruned = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[1], id) == 0 and redis.call('HDEL', KEYS[2], id) == 1 then
    pruned = pruned + 1
  end
end
return pruned
