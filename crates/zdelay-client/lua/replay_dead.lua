-- replay_dead: make dead envelope jobs due again, keeping their envelopes.
-- KEYS[1] due      ZSET  {zdelay:3}:due
-- KEYS[2] jobs     HASH  {zdelay:3}:jobs
-- KEYS[3] dead     ZSET  {zdelay:3}:dead
-- KEYS[4] reasons  HASH  {zdelay:3}:reasons
-- KEYS[5] shards    STRING {zdelay:3}:shards     layout marker: the shard count once resharded, or
--                                                "migrating <from> <to>" (no marker: never resharded)
-- ARGV[1] the caller's shard count. A marker that differs refuses the call, writing nothing:
--   error ZDELAY_RESHARDED <shards>, or ZDELAY_MIGRATING <from> <to> while zdelay reshard runs
-- ARGV[2] due ms for the replayed jobs; "" = Redis TIME (due now)
-- ARGV[3] wake channel; ARGV[4] shard number
-- ARGV[5..] ids
-- Returns: { replayed, orphans } where orphans are dead ids without an envelope: they stay
--   dead with their reason (there is nothing to deliver). Ids that are not dead are skipped.
-- Re-run safety: yes.

-- Layout fence: refuse a shard its caller computed with another shard count.
local layout = redis.call('GET', KEYS[5])
if layout and layout ~= ARGV[1] then
  if string.sub(layout, 1, 10) == 'migrating ' then
    return redis.error_reply('ZDELAY_MIGRATING ' .. string.sub(layout, 11))
  end
  return redis.error_reply('ZDELAY_RESHARDED ' .. layout)
end
local due = ARGV[2]
if due == '' then
  local t = redis.call('TIME')
  due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local replayed, orphans = 0, 0
for i = 5, #ARGV do
  local id = ARGV[i]
  if redis.call('ZSCORE', KEYS[3], id) then
    if redis.call('HEXISTS', KEYS[2], id) == 1 then
      redis.call('ZREM', KEYS[3], id)
      redis.call('HDEL', KEYS[4], id)
      redis.call('ZADD', KEYS[1], due, id)
      replayed = replayed + 1
    else
      orphans = orphans + 1
    end
  end
end
if replayed > 0 then redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' ' .. string.format('%d', due)) end
return { replayed, orphans }
