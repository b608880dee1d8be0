-- replay_dead: make dead envelope jobs due again, keeping their envelopes.
-- KEYS[1] due      ZSET  {zdelay:3}:due
-- KEYS[2] jobs     HASH  {zdelay:3}:jobs
-- KEYS[3] dead     ZSET  {zdelay:3}:dead
-- KEYS[4] reasons  HASH  {zdelay:3}:reasons
-- ARGV[1] due ms for the replayed jobs; "" = Redis TIME (due now)
-- ARGV[2] wake channel; ARGV[3] shard number
-- ARGV[4..] ids
-- Returns: { replayed, orphans } where orphans are dead ids without an envelope: they stay
--   dead with their reason (there is nothing to deliver). Ids that are not dead are skipped.
-- Re-run safety: yes.
local due = ARGV[1]
if due == '' then
  local t = redis.call('TIME')
  due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local replayed, orphans = 0, 0
for i = 4, #ARGV do
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
if replayed > 0 then redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' ' .. string.format('%d', due)) end
return { replayed, orphans }
