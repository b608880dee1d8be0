-- retire_lane: retire a route lane whose route's list moved to another hash slot, only if it
-- holds nothing, checked in the same script that retires it. A producer that read the lane's
-- marker earlier may enqueue into it until the marker changes: checked apart, a job could land
-- between the check and the retirement and stay where no mover reads. Run before the registry
-- names the successor, so the lane is never retired while the registry still sends work to it
-- and a producer refused here (ZDELAY_LANE_MOVED) finds the successor when it reads again.
-- KEYS[1] due        ZSET   zdelay:{emj}:due:<route>
-- KEYS[2] jobs       HASH   zdelay:{emj}:jobs:<route>
-- KEYS[3] dead       ZSET   zdelay:{emj}:dead:<route>
-- KEYS[4] schedules  HASH   zdelay:{emj}:schedules:<route>
-- KEYS[5] marker     STRING zdelay:{emj}:lane:<route>  "2 <lane> <LPUSH|RPUSH> <list key>" while
--                                                       live, "retired <successor>" once moved
-- ARGV[1] the lane's live marker as registered; ARGV[2] the successor lane number (base 36)
-- Returns: { 1 } retired now, or retired already by an earlier run (its successor rewritten);
--   { 0, waiting, dead, schedules, stored } when the lane holds anything: nothing is changed.
--   A marker that is neither ARGV[1] nor a retired one: error ZDELAY_LANE_CHANGED <marker>
--   (another registration changed the lane meanwhile; nothing is changed).
-- Re-run safety: yes; a retired lane refuses every write, so it stays empty.

local marker = redis.call('GET', KEYS[5])
if marker and marker ~= ARGV[1] and string.sub(marker, 1, 8) ~= 'retired ' then
  return redis.error_reply('ZDELAY_LANE_CHANGED ' .. marker)
end
local waiting = redis.call('ZCARD', KEYS[1])
local dead = redis.call('ZCARD', KEYS[3])
local schedules = redis.call('HLEN', KEYS[4])
local stored = redis.call('HLEN', KEYS[2])
if waiting + dead + schedules + stored > 0 then
  return { 0, waiting, dead, schedules, stored }
end
redis.call('SET', KEYS[5], 'retired ' .. ARGV[2])
return { 1 }
