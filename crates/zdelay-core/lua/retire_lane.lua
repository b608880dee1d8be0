-- retire_lane: retire a route lane whose route's list moved to another hash slot. From then on
-- every lane script refuses the lane (ZDELAY_LANE_MOVED <successor>): no producer writes into it,
-- no mover delivers from it, so what it holds stays put until the relocation (store::relocate)
-- moves it into the successor. Run before the registry names the successor, so the lane is never
-- retired while the registry still sends work to it and a producer refused here finds the
-- successor when it reads again.
-- KEYS[1] due        ZSET   zdelay:{emj}:due:<route>
-- KEYS[2] jobs       HASH   zdelay:{emj}:jobs:<route>
-- KEYS[3] dead       ZSET   zdelay:{emj}:dead:<route>
-- KEYS[4] schedules  HASH   zdelay:{emj}:schedules:<route>
-- KEYS[5] marker     STRING zdelay:{emj}:lane:<route>  "2 <lane> <LPUSH|RPUSH> <list key>" while
--                                                       live, "retired <successor>" once moved
-- ARGV[1] the lane's live marker as registered; ARGV[2] the successor lane number (base 36)
-- Returns: { waiting, dead, schedules, stored payloads } the lane holds as it is retired (now, or
--   by an earlier run: its successor is rewritten). A marker that is neither ARGV[1] nor a retired
--   one: error ZDELAY_LANE_CHANGED <marker> (another registration changed the lane meanwhile;
--   nothing is changed).
-- Re-run safety: yes; a retired lane refuses every write but the relocation's.

local marker = redis.call('GET', KEYS[5])
if marker and marker ~= ARGV[1] and string.sub(marker, 1, 8) ~= 'retired ' then
  return redis.error_reply('ZDELAY_LANE_CHANGED ' .. marker)
end
redis.call('SET', KEYS[5], 'retired ' .. ARGV[2])
return { redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[3]), redis.call('HLEN', KEYS[4]),
  redis.call('HLEN', KEYS[2]) }
