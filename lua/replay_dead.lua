-- replay_dead: make dead envelope jobs due again (attempts reset), keeping their envelopes.
-- KEYS[1] due      ZSET  {zdelay:3}:due
-- KEYS[2] jobs     HASH  {zdelay:3}:jobs
-- KEYS[3] dead     ZSET  {zdelay:3}:dead
-- KEYS[4] reasons  HASH  {zdelay:3}:reasons
-- ARGV[1] due ms for the replayed jobs; "" = Redis TIME (due now)
-- ARGV[2] wake channel; ARGV[3] shard number
-- ARGV[4..] ids; none = the oldest 1000 dead jobs of the shard
-- Returns: the number of jobs replayed (ids not dead are skipped)
-- Re-run safety: yes.
local due = ARGV[1]
if due == '' then
  local t = redis.call('TIME')
  due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local ids = {}
if #ARGV >= 4 then
  for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('ZRANGE', KEYS[3], 0, 999)
end
local count = 0
for _, id in ipairs(ids) do
  if redis.call('ZREM', KEYS[3], id) == 1 then
    redis.call('HDEL', KEYS[4], id)
    if redis.call('HEXISTS', KEYS[2], id) == 1 then
      redis.call('ZADD', KEYS[1], due, id)
      count = count + 1
    end
  end
end
if count > 0 then redis.call('PUBLISH', ARGV[2], ARGV[3] .. ' ' .. string.format('%d', due)) end
return count
